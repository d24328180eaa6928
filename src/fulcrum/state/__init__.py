"""The daemon's mutable in-memory tables. They call the pure core and hold its results."""
