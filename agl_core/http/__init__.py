"""HTTP serving in one place: the rules every server applies, and the server thread."""
