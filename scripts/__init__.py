"""treedraft.scripts: the ``treedraft`` command line (thin entry points)."""
