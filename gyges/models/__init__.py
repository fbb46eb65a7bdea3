"""Models: what a checkpoint says (config), how it is read (checkpoint, safetensors, gguf_file),
its text (tokenizer) and the loaded model (model). Nothing here knows about workers or memory."""
