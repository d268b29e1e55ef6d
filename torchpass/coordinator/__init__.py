"""The per-job coordinator: one process per torchpass job, on the batch host.

It keeps the job's state (ranks, their nodes and progress, events), answers
queries over ZeroMQ, and decides and drives rank moves.

The decision core is pure and clock-injected, and loads no zmq or structlog:
``phases`` (Phase and the transition table), ``model`` (state types),
``contract`` (actions and outcomes), ``decide`` (one handler per phase) and
``machine`` (applying outcomes). I/O lives in ``executor`` (Driver,
Executor), ``server`` (sockets) and ``main`` (the tpass-coordinator command).
"""
