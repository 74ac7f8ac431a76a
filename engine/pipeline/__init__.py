"""The layer-split pipeline: the session, its stages (threads or processes), a run, the wire and the rendezvous."""
