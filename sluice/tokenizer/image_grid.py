"""The prompt of an image split into tiles (Idefics3 / SmolVLM), as token ids.

transformers' processor replaces each `<image>` of the prompt text by, for a grid of R x C
tiles:

    for each row r, for each column c:  <fake_token_around_image><row_r_col_c><image>*L
    after each row:                      "\\n"
    then the global image:               "\\n"<fake_token_around_image><global-img><image>*L
                                         <fake_token_around_image>

and for an image not split only the global part (without its leading "\\n"). Every marker is a
special token of the tokenizer, so the text between two of them is tokenized on its own: a row
ends in the ids of "\\n", and the last row in those of "\\n\\n" (its newline and the global
image's). `template` gives that sequence with `TILE` where each tile's L positions go, which is
exactly the processor's token sequence once the tiles are filled in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TOKEN = "<global-img>"
MAX_GRID = 6  # the tokenizers have <row_r_col_c> for r, c in 1..6

TILE = -1  # in a template: one tile's run of image positions


def _row_col(r: int, c: int) -> str:
    return f"<row_{r}_col_{c}>"


@dataclass(frozen=True)
class GridMarkers:
    """The ids of the markers around an image's tiles, read once from the tokenizer."""

    fake: int
    global_img: int
    row_col: dict[tuple[int, int], int]  # (r, c), 1-based -> id
    newline: list[int]  # "\n"
    double_newline: list[int]  # "\n\n"

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> GridMarkers:
        """Raises ValueError when a marker is not one token of `tokenizer`."""

        def one_token(text: str) -> int:
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) != 1:
                raise ValueError(f"the tokenizer has no token {text!r} (the image prompt's)")
            return ids[0]

        grid = range(1, MAX_GRID + 1)
        return cls(
            fake=one_token(FAKE_TOKEN),
            global_img=one_token(GLOBAL_TOKEN),
            row_col={(r, c): one_token(_row_col(r, c)) for r in grid for c in grid},
            newline=tokenizer.encode("\n", add_special_tokens=False),
            double_newline=tokenizer.encode("\n\n", add_special_tokens=False),
        )

    def template(self, rows: int, cols: int) -> list[int]:
        """The image's ids for a grid of `rows` x `cols` tiles ((0, 0): not split), `TILE` at
        each tile (row-major, the global image last). ValueError for a grid without markers."""
        global_part = [self.fake, self.global_img, TILE, self.fake]
        if rows == 0 and cols == 0:
            return global_part
        if not (1 <= rows <= MAX_GRID and 1 <= cols <= MAX_GRID):
            raise ValueError(f"a grid of {rows}x{cols} tiles; at most {MAX_GRID}x{MAX_GRID}")
        out: list[int] = []
        for r in range(1, rows + 1):
            for c in range(1, cols + 1):
                out += [self.fake, self.row_col[(r, c)], TILE]
            out += self.newline if r < rows else self.double_newline
        return out + global_part
