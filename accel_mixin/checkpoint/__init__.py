"""Files users can trust: atomic writes, safe reads, ``save_params`` and
``load_params`` on every process."""
