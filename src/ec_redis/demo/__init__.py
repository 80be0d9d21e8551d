"""The ``ec-redis demo`` kit: a tiny local vision-language model, engine runs, the report.

Nothing here is imported by the cache or the connector. Modules import vLLM, transformers
and Pillow only inside the functions that need them, so ``ec_redis`` imports without vLLM;
``drive.py`` (the connector's hooks driven without an engine) imports the connector at its
top and is itself imported only inside functions.
"""
