"""Whether a process still runs, for the files a process leaves behind it.

Lock files and temporary files carry the id of the process that wrote them; a
reader may take over or remove them only once that process is gone.
"""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (signal 0 probes without signalling).

    Only ``ProcessLookupError`` proves the process gone; any other refusal
    (``PermissionError``: another user's process) counts as alive, so that a file
    of a process we cannot probe is never taken over or removed.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
