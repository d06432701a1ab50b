"""The agents of kf: archivist, mutator, compiler, verifier, profiler, prompt evolver."""
