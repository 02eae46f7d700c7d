"""One dispatch point per op; the model calls these, never an implementation directly."""
