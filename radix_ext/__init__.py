"""SGLang integration (import kvsieve.radix_ext): the plugin entry point and,
with the compressed region, its allocator, attention backend and admission."""
