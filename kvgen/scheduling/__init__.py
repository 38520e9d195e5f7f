"""The scheduling layer: a request's state as it runs (sequence.py), who runs each step and how many
tokens (scheduler.py), and the step handed to the runner (output.py), the one module the runner reads."""
