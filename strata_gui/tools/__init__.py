"""Developer tools: the self-test, screenshots, the Gantt redraw benchmark."""
