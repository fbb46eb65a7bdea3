/* gytest.h: the smallest test runner that does what we need: tests register themselves, CHECKs
 * record failures without stopping the run, and main prints "N passed, N failed" and exits
 * non-zero on any failure. Built together with the core under ASan and UBSan by `make ctest`. */
#ifndef GY_TEST_H
#define GY_TEST_H

#include <stdio.h>

typedef void (*gytest_fn)(void);
void gytest_register(const char *name, gytest_fn fn);
void gytest_fail(const char *file, int line, const char *expr);

#define GYTEST(name)                                                                               \
    static void name(void);                                                                        \
    __attribute__((constructor)) static void gytest_register_##name(void) {                       \
        gytest_register(#name, name);                                                              \
    }                                                                                              \
    static void name(void)

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) gytest_fail(__FILE__, __LINE__, #cond);                                       \
    } while (0)

/* CHECK that a gy_status call returned `expected`. */
#define CHECK_STATUS(call, expected)                                                               \
    do {                                                                                           \
        gy_status gytest_s_ = (call);                                                              \
        if (gytest_s_ != (expected)) {                                                             \
            char gytest_msg_[1200];                                                                \
            snprintf(gytest_msg_, sizeof gytest_msg_, "%s returned %d (%s), expected %d",          \
                     #call, (int)gytest_s_, gy_error_message(), (int)(expected));                  \
            gytest_fail(__FILE__, __LINE__, gytest_msg_);                                          \
        }                                                                                          \
    } while (0)
#define CHECK_OK(call) CHECK_STATUS(call, GY_OK)

#endif
