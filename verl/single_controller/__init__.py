"""The single controller: one driver process drives a group of rank workers (Ray actors)."""
