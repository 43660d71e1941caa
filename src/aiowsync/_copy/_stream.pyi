from typing_extensions import Buffer

STREAMS: bool
STREAM_MIN_BYTES: int

def copy_moves(moves: Buffer, /) -> None: ...
