"""``kf lessons list|show|import|export|retire``: the lesson library of this machine
(``lessons.jsonl`` in kf's cache folder, or ``--lessons PATH``), issue 48.

``import`` takes a run's log (its ``lesson.learned`` decisions) or another library file
(read as hostile data: :mod:`kf.llm.lessons`); a library kf cannot read is one line and
changes nothing. ``kf run --lessons PATH`` records the library's lessons in the run
(``lesson.loaded``), and the run's prompts quote those chosen for them; at the run's end
it writes back what the run decided about them (:func:`write_back`: uses, controlled
comparisons, gains, verified or retired) and adds the lessons it learned.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from kf.llm.lessons import LibraryError, clean, default_path, read_library, write_library
from kf.search_facts import Lesson, LessonsLoaded

__all__ = ["add_parser", "cmd_lessons", "loaded_event", "write_back"]

#: the events a run's write-back reads
_WRITTEN_BACK = ("prompt.chosen", "lesson.compared", "lesson.verified", "lesson.retired")


def add_parser(sub: Any) -> None:
    """``kf lessons``'s parser, under the ``kf`` command's subparsers."""
    ls = sub.add_parser("lessons", help="list, show, import, export or retire lessons")
    ls.add_argument("action", choices=("list", "show", "import", "export", "retire"))
    ls.add_argument("target", nargs="?", default=None, help="a lesson id (or its prefix), "
                    "a run's log or a library file to import, a file to export to")  # fmt: skip
    ls.add_argument("--lessons", type=Path, default=None, help="the library (default: "
                    "lessons.jsonl in kf's cache folder)")  # fmt: skip
    ls.add_argument("--json", action="store_true", help="list as JSON lines")
    ls.set_defaults(func=cmd_lessons)


def loaded_event(path: Path) -> LessonsLoaded:
    """What ``kf run --lessons PATH`` records; raises :class:`LibraryError`."""
    lessons, refused = read_library(path)
    live = tuple(x for x in lessons if x.status != "retired")
    return LessonsLoaded(path=str(path), lessons=live, refused=tuple(refused))


def write_back(path: Path, envelopes: list[Any]) -> str:
    """Fold a finished run's decisions about lessons into the library at ``path`` (as it
    is now: another run may have written it meanwhile) and add the lessons the run
    learned; one line says what changed, or why nothing did (a library kf cannot read is
    left as it is)."""
    from agents.lessons import counted
    from kf.events import decode_event
    from kf.search_facts import LessonLearned

    try:
        lessons, _ = read_library(path)
    except (LibraryError, OSError) as exc:
        return f"kf run: lessons not written back: {exc}"
    events = [decode_event(e) for e in envelopes if e.type in _WRITTEN_BACK]
    learned = [
        clean(ev.lesson)
        for ev in (decode_event(e) for e in envelopes if e.type == LessonLearned.tag)
        if isinstance(ev, LessonLearned)
    ]
    known = {x.lesson_id for x in lessons}
    run_id = envelopes[0].run_id if envelopes else ""
    updated = [counted(x, run_id, events) for x in lessons]
    changed = sum(1 for a, b in zip(lessons, updated, strict=True) if a != b)
    added = [x for x in learned if x.lesson_id not in known]
    if not changed and not added:
        return f"kf run: lessons: nothing to write back to {path}"
    write_library(path, [*updated, *added])
    return f"kf run: lessons written back to {path}: {changed} updated, {len(added)} learned"


def _from_log(db: Path) -> list[Lesson]:
    from kf.events import decode_event
    from kf.log import EventLog
    from kf.search_facts import LessonLearned

    with EventLog(db, readonly=True) as elog:
        events = [decode_event(e) for e in elog.read(types=[LessonLearned.tag])]
    return [clean(e.lesson) for e in events if isinstance(e, LessonLearned)]


def _find(lessons: list[Lesson], key: str | None) -> Lesson | str:
    found = [x for x in lessons if key and x.lesson_id.startswith(key)]
    if len(found) != 1:
        return (
            f"{'no' if not found else 'more than one'} lesson matches {key!r}; see kf lessons list"
        )
    return found[0]


def _import(lessons: list[Lesson], target: Path) -> tuple[list[Lesson], str]:
    if target.suffix == ".db":
        new, refused = _from_log(target), list[str]()
    else:
        new, refused = read_library(target)
    known = {x.lesson_id: x for x in lessons}
    added = [x for x in new if x.lesson_id not in known]
    known.update({x.lesson_id: x for x in added})
    note = f"imported {len(added)} lesson(s) from {target} ({len(new) - len(added)} known)"
    return list(known.values()), "\n".join([note, *refused])


def cmd_lessons(args: argparse.Namespace) -> int:
    """Run one ``kf lessons`` action; a bad library or target is one line, exit 2."""
    path = args.lessons or default_path()
    try:
        lessons, refused = read_library(path)
        out = _act(args, path, lessons)
    except (LibraryError, OSError, ValueError) as exc:
        print(f"kf lessons: {exc}", file=sys.stderr)
        return 2
    for line in refused:
        print(f"kf lessons: {line}", file=sys.stderr)
    if isinstance(out, str) and out.startswith("!"):
        print(f"kf lessons: {out[1:]}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _act(args: argparse.Namespace, path: Path, lessons: list[Lesson]) -> str:
    if args.action == "list":
        if args.json:
            return "\n".join(msgspec.json.encode(x).decode() for x in lessons)
        rows = [
            f"{x.lesson_id[:12]}  {x.status:<10} {x.kind:<11} {x.task:<20} "
            f"{'' if x.gain is None else f'{x.gain:.2f}x':<6} used {x.uses}, "
            f"{x.wins}/{x.comparisons} comparisons gained"
            + ("" if x.bought is None else f", bought {x.bought:.2f}x")
            for x in lessons
        ]
        return "\n".join(rows) or f"no lessons in {path}"
    if args.action in ("show", "retire"):
        found = _find(lessons, args.target)
        if isinstance(found, str):
            return "!" + found
        if args.action == "show":
            return msgspec.json.format(msgspec.json.encode(found).decode(), indent=2)
        retired = msgspec.structs.replace(found, status="retired")
        write_library(path, [retired if x is found else x for x in lessons])
        return f"retired {found.lesson_id} ({time.strftime('%Y-%m-%d')})"
    if args.target is None:
        return f"!{args.action} needs a file"
    target = Path(args.target)
    if args.action == "export":
        write_library(target, lessons)
        return f"exported {len(lessons)} lesson(s) to {target}"
    merged, note = _import(lessons, target)
    write_library(path, merged)
    return note
