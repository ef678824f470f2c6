"""Write configs/data/real/: the instruction data of the real-model pipeline (configs/real.yaml,
issue 29), generated here from templates with a fixed seed, so the files are reproducible and
carry no third party's text.

    .venv/bin/python scripts/make_real_data.py [--check]

Four tasks SmolLM2-135M-Instruct does badly out of the box (it answers at length, or in its own
format) and can learn at its size, each with a fixed answer format:

    convert   unit conversion with whole numbers       "Convert 7 km to metres. ..."       -> "7000"
    json      extraction into JSON with fixed keys     "Extract ... as JSON ...: Ana, 34"  -> {"name": "Ana", "age": 34}
    add       two-digit arithmetic                     "What is 38 plus 45? ..."           -> "83"
    date      a date written in ISO 8601               "Write 7 March 2024 as ..."         -> "2024-03-07"

Files (the formats of configs/data/*.jsonl, which configs/user_data.yaml runs on; docs/pipelines.md):
    sft.jsonl      chat rows (messages), for SFT
    prefs.jsonl    preference pairs: the right answer against a plausible wrong or verbose one
    prompts.jsonl  prompts with reference answers, for on-policy DPO and GRPO (exact-match reward)
    eval.jsonl     held-out prompts with answers: no prompt of it appears in the other files
    general.jsonl  general English text, for the perplexity guard (what post-training lost): 100
                   paragraphs of the Python documentation's topics as CPython ships them in its
                   standard library (`pydoc_data.topics`, Python Software Foundation License 2.0),
                   each the completion of a prompt naming its topic; no task data comes near it

`--check` exits 1 if the files on disk differ from what this script writes (a test runs it);
general.jsonl only under the Python it was written with (PYDOC_PYTHON), as its text comes from there.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import re
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "configs" / "data" / "real"
SEED = 20261207
SIZES = {"sft": 2000, "prefs": 800, "prompts": 400, "eval": 200, "general": 100}
PYDOC_PYTHON = "3.11.7"  # the Python whose pydoc_data.topics general.jsonl was written from

# (from, to, factor, how the amount is named in each unit)
UNITS = [("km", "metres", 1000), ("metres", "centimetres", 100), ("kg", "grams", 1000),
         ("hours", "minutes", 60), ("minutes", "seconds", 60), ("days", "hours", 24),
         ("litres", "millilitres", 1000), ("weeks", "days", 7), ("cm", "millimetres", 10)]
CONVERT = ["Convert {v} {a} to {b}. Reply with the number only.",
           "How many {b} are in {v} {a}? Reply with the number only.",
           "{v} {a} is how many {b}? Give just the number."]
NAMES = ["Ana", "Ben", "Chloe", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemal", "Lena",
         "Mateo", "Nadia", "Omar", "Priya", "Quentin", "Rosa", "Sven", "Tariq", "Uma", "Victor", "Wen", "Yusuf"]
CITIES = ["Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Toronto", "Kraków", "Porto", "Seoul", "Dakar", "Quito",
          "Tallinn", "Adelaide", "Bergen", "Cusco", "Valencia"]
SENTENCES = ["{name} is {age} years old and lives in {city}.", "At {age}, {name} moved to {city}.",
             "My neighbour {name} turned {age} last week; she grew up in {city}.",
             "{name} ({age}) works at a bakery in {city}.", "Born in {city}, {name} is now {age}."]
JSON_ASK = ["Extract the person's name and age as JSON with keys \"name\" and \"age\": {s}",
            "Return JSON with the keys \"name\" and \"age\" for this sentence: {s}"]
ADD = ["What is {a} plus {b}? Reply with the number only.", "Add {a} and {b}. Give just the number.",
       "{a} + {b} = ? Reply with the number only."]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
DATE = ["Write {d} {m} {y} as YYYY-MM-DD.", "Give the date {d} {m} {y} in ISO format (YYYY-MM-DD).",
        "Format {m} {d}, {y} as YYYY-MM-DD."]
TASKS = ("convert", "json", "add", "date")


def example(task: str, rng: random.Random) -> tuple[str, str, str]:
    """(prompt, answer, a wrong or verbose answer) for one draw of `task`."""
    if task == "convert":
        a, b, f = rng.choice(UNITS)
        v = rng.randint(2, 30)
        right = v * f
        wrong = rng.choice([str(right // 10), str(right * 10), f"{v} {a} is {right} {b}.", str(v + f)])
        return rng.choice(CONVERT).format(v=v, a=a, b=b), str(right), wrong
    if task == "json":
        name, age, city = rng.choice(NAMES), rng.randint(19, 88), rng.choice(CITIES)
        s = rng.choice(SENTENCES).format(name=name, age=age, city=city)
        right = json.dumps({"name": name, "age": age})
        wrong = rng.choice([json.dumps({"name": name, "age": str(age)}), json.dumps({"name": name, "city": city}),
                            f"The name is {name} and the age is {age}."])
        return rng.choice(JSON_ASK).format(s=s), right, wrong
    if task == "add":
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        wrong = rng.choice([str(a + b + rng.choice([-10, -1, 1, 10])), f"{a} plus {b} is {a + b}."])
        return rng.choice(ADD).format(a=a, b=b), str(a + b), wrong
    d, m, y = rng.randint(1, 28), rng.randint(1, 12), rng.randint(1990, 2030)
    right = f"{y:04d}-{m:02d}-{d:02d}"
    wrong = rng.choice([f"{y:04d}-{d:02d}-{m:02d}" if d != m and d <= 12 else f"{d:02d}/{m:02d}/{y:04d}",
                        f"{d:02d}-{m:02d}-{y:04d}", f"The date is {right}."])
    return rng.choice(DATE).format(d=d, m=MONTHS[m - 1], y=y), right, wrong


def build() -> dict[str, list[dict]]:
    rng = random.Random(SEED)
    held_out: set[str] = set()
    files: dict[str, list[dict]] = {}
    for name in ("eval", "sft", "prefs", "prompts"):  # eval first: the others skip its prompts
        rows, seen = [], set()
        while len(rows) < SIZES[name]:
            task = TASKS[len(rows) % len(TASKS)]
            prompt, right, wrong = example(task, rng)
            if prompt in seen or (name != "eval" and prompt in held_out):
                continue
            seen.add(prompt)
            user = [{"role": "user", "content": prompt}]
            if name == "sft":
                rows.append({"messages": user + [{"role": "assistant", "content": right}], "task": task})
            elif name == "prefs":
                rows.append({"prompt": user, "chosen": [{"role": "assistant", "content": right}],
                             "rejected": [{"role": "assistant", "content": wrong}], "task": task})
            else:
                rows.append({"prompt": user, "answer": right, "task": task})
        if name == "eval":
            held_out = seen
        files[name] = rows
    files["general"] = general(rng)
    return files


def general(rng: random.Random) -> list[dict]:
    """SIZES["general"] paragraphs of 300-700 characters of prose (no lists, prompts or code-heavy
    lines) from the Python documentation's topics, drawn with `rng`, in topic order."""
    from pydoc_data.topics import topics

    paragraphs = []
    for topic in sorted(topics):
        for text in re.split(r"\n\s*\n", topics[topic]):
            text = " ".join(text.split())
            if 300 <= len(text) <= 700 and text[0].isupper() and text.count("(") < 6:
                paragraphs.append((topic, text))
    chosen = sorted(rng.sample(range(len(paragraphs)), SIZES["general"]))
    return [{"prompt": [{"role": "user", "content": f"Write a paragraph of the Python documentation on {topic}."}],
             "completion": [{"role": "assistant", "content": text}], "source": f"pydoc_data.topics:{topic}"}
            for topic, text in (paragraphs[i] for i in chosen)]


def render(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the files differ from what would be written")
    args = p.parse_args(argv)
    stale = []
    for name, rows in build().items():
        path = OUT / f"{name}.jsonl"
        text = render(rows)
        if args.check:
            if name == "general" and platform.python_version() != PYDOC_PYTHON:
                print(f"{path}: not checked (written from Python {PYDOC_PYTHON}'s pydoc_data, this is "
                      f"{platform.python_version()})")
                continue
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(str(path))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"{path}: {len(rows)} rows")
    if stale:
        print("stale (run scripts/make_real_data.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
