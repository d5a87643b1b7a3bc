"""The ground every room stands on: the one-line errors (errors.py), atomic files and link
refusal (files.py), the knobs' typed rules (knobs.py), SIGTERM as an exception where a process
has cleaning up to do (signals.py), and the processes, devices and parallel layout
(distributed.py). It imports nothing of the project above it."""
