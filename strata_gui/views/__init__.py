"""The widgets: the main window, its panels and tabs, and their styling helpers."""
