"""One run of the engine from the app: settings, the job and its worker, records, live stores (no widgets)."""
