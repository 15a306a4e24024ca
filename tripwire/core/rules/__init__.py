"""Rules: the base class, the engine, and the built-in rules (one module per kind of data they read)."""
