"""The per-job coordinator: one process per torchpass job, on the batch host.

It keeps the job's state (ranks, their nodes and progress, events), answers
queries over ZeroMQ, and (with the migration work) decides and drives rank
moves. The decision core is pure and clock-injected; I/O lives in server.py.
"""
