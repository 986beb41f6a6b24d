"""What crosses a process boundary: every message, its codec, the state digest, transport
security, the control server, logging set-up and the engine's configuration.

`orchestrator/`, `scheduler/` and `worker/` are peers over this package and import
nothing from each other. Messages are grouped by hop:

    config.py      EngineConfig: built from the command line, sent to every process
    client.py      shim <-> scheduler: requests, their outputs, the engine's counters
    step.py        scheduler <-> ranks: one StepPlan to every rank, one StepResult back
    threads.py     the OpenMP wait policy every torch child starts with
    lifecycle.py   hellos, readiness and goodbyes of ranks and the shim
    control.py     deepinfer-inspect <-> any process's control socket

All of them are plain dataclasses encoded by the one msgpack codec (`codec.py`, with its
schema version); nothing is ever pickled.
"""
