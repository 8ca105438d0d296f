"""Generate the README's policy table from the registry (``python -m kvpress.docs``)."""

from __future__ import annotations

import pathlib
import sys

START, END = "<!-- policy-table:start -->", "<!-- policy-table:end -->"


def policy_table() -> str:
    import kvpress

    yes = {True: "yes", False: "no"}
    chunked = {True: "as one forward", False: "reads quantized pieces"}
    assisted = {(True, True): "as plain decoding", (True, False): "yes (tokens may differ)", (False, True): "no",
                (False, False): "no"}
    lines = ["| policy | what it does | paper | keeps full cache | prefill is full attention | assisted decoding "
             "| chunked prefill |",
             "|---|---|---|---|---|---|---|"]
    for name in kvpress.list_policies():
        cls = kvpress.policy_class(name)
        lines.append(
            f"| `{name}` | {cls.description} | {cls.paper or '-'} | {yes[cls.keeps_full_cache]} | "
            f"{yes[cls.full_prefill]} | {assisted[cls.croppable, cls.verifies_as_decoding]} | "
            f"{chunked[cls.chunked_prompt_exact]} |"
        )
    return "\n".join(lines)


def render_readme(text: str) -> str:
    """``text`` with the block between the policy-table markers replaced by the current table."""
    if START not in text or END not in text:
        raise ValueError(f"README has no {START} ... {END} block")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{policy_table()}\n{END}{tail}"


def main(argv=None) -> int:
    path = pathlib.Path(argv[0] if argv else "README.md")
    path.write_text(render_readme(path.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"updated the policy table in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
