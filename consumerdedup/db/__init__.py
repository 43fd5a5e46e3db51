"""Database helpers below everything else: partitions, SQLite transactions, advisory locks."""
