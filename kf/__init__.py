"""kf: evolutionary search for fast, correct kernels, as an event-sourced actor system."""
