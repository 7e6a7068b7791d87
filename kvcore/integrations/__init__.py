"""Integrations of kvcore into other libraries, each an optional extra; importing kvcore
never imports them (`kvcore.integrations.transformers` needs `pip install kvcore[hf]`)."""
