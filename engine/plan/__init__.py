"""Planning before and around a run: chunk choice, layer split choice, memory plan and check, the what-if planner, roofline."""
