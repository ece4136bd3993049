"""The wire: what travels between a client and the daemon, and nothing else.

protocol.py (every message, typed and versioned, declared once), lane.py (the serve lane's framing and its
client end; the daemon's end is daemon/lane_server.py), tensors.py (serve-mode tensors on the wire, the feed
check both sides share). The wire sits just above the foundation: it imports nothing of the store, the tiers,
the daemon or the client. Importing this folder loads nothing: each module loads when it is named.
"""
