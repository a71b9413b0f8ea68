"""Channels between the engine's processes: a trio memory channel's contract over a Unix socket.

:mod:`.frames` (the wire format) and :mod:`.flow` (credit accounting) are pure Python and import no trio, so
this package's ``__init__`` re-exports nothing; :mod:`.channel` is the trio shell around them
(``from inference_server.ipc.channel import open_socket_channel``).
"""
