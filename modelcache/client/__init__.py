"""Client side: the connection to the daemon and the drop-in InferenceSession."""
