/* main.c: runs every GYTEST registered by the files beside it. An argument runs only the tests
 * whose name contains it. */
#include <stdlib.h>
#include <string.h>

#include "gytest.h"

#define GYTEST_MAX 512

static struct { const char *name; gytest_fn fn; } gytest_registry[GYTEST_MAX];
static int gytest_count;
static int gytest_current_failed;

void gytest_register(const char *name, gytest_fn fn) {
    if (gytest_count < GYTEST_MAX) {
        gytest_registry[gytest_count].name = name;
        gytest_registry[gytest_count].fn = fn;
        gytest_count++;
    }
}

void gytest_fail(const char *file, int line, const char *expr) {
    fprintf(stderr, "  FAIL %s:%d: %s\n", file, line, expr);
    gytest_current_failed = 1;
}

int main(int argc, char **argv) {
    int passed = 0, failed = 0;
    for (int i = 0; i < gytest_count; i++) {
        if (argc > 1 && strstr(gytest_registry[i].name, argv[1]) == NULL) continue;
        gytest_current_failed = 0;
        gytest_registry[i].fn();
        if (gytest_current_failed) {
            fprintf(stderr, "FAILED %s\n", gytest_registry[i].name);
            failed++;
        } else {
            passed++;
        }
    }
    printf("ctest: %d passed, %d failed\n", passed, failed);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
