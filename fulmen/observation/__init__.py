"""Observation: the Python state a program reads and writes while it is acquired (found by the frame tap and the
read sites of its code), turned into the guards a cached trace is reused behind, the writes every call replays, and
refusals of what no call could repeat."""
