"""The Tinker API (Thinking Machines' training API) served by art-ray: the official `tinker` SDK, pointed at
this server, runs its training loop unchanged. api.py is the HTTP front; types.py the seam to the trainer
and engines behind it."""
