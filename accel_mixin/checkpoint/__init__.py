"""Files users can trust: atomic writes, safe reads, clear errors; skorch's
``save_params`` and ``load_params`` on top of them (``SafeParamsMixin``)."""
