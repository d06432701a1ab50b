"""What crosses the wall between grader and runner: the protocol's structs and their
codec (:mod:`.protocol`), and what those structs are made of: the sealed memory files
that carry large payloads (:mod:`.shared_memory`, :mod:`.file_maker`), the tolerance
(:mod:`.tolerance`) and the verdict (:mod:`.verdict`). Both sides import it; it imports
neither.
"""
