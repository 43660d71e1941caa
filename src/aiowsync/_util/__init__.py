"""Small primitives every layer uses: work that survives cancellation (``shield``), blocking
work that may outlive its caller (``daemon``), a wake-all signal (``signal``), text fit for
logs and the wire (``text``), the C library (``libc``), and whether a process lives
(``pids``).

May import: nothing of aiowsync.
"""
