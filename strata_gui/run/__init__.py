"""One run of the engine from the app: settings, the job and its controller, records, live stores (no widgets)."""
