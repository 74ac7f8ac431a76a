"""Draw the app icon: assets/strata.png (256 px) and assets/strata.ico (16…256 px).

    python packaging/make_icon.py            # rewrites both files (commit them)

The motif is the app's own picture: a pipeline Gantt of three stages, each running its chunks a
step after the stage above, in the Okabe-Ito colours the views use, on a dark rounded square.
Every size is drawn from the same vectors, so small icons stay sharp.  Only Qt is needed (no
Pillow); the .ico is written here: BMP entries up to 128 px, a PNG entry for 256 px (what
Windows Explorer reads best).
"""
from __future__ import annotations

import os
import struct
import sys
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QBuffer, QByteArray, QIODevice, QRectF, Qt  # noqa: E402
from PySide6.QtGui import QColor, QGuiApplication, QImage, QPainter  # noqa: E402

ASSETS = Path(__file__).resolve().parents[1] / "assets"
ICO_SIZES = (16, 24, 32, 48, 64, 128, 256)
PNG_SIZE = 256

BACKGROUND = "#1F2933"
# stage rows, top to bottom: (colour, first block column); blocks are one column wide with a gap
ROWS = (("#56B4E9", 0), ("#009E73", 1), ("#E69F00", 2))
COLUMNS = 5  # the grid: chunk columns across the square
BLOCKS_PER_ROW = 3


def draw(size: int) -> QImage:
    img = QImage(size, size, QImage.Format.Format_ARGB32)
    img.fill(Qt.GlobalColor.transparent)
    p = QPainter(img)
    p.setRenderHint(QPainter.RenderHint.Antialiasing)
    s = float(size)
    p.setPen(Qt.PenStyle.NoPen)
    p.setBrush(QColor(BACKGROUND))
    p.drawRoundedRect(QRectF(0, 0, s, s), 0.18 * s, 0.18 * s)

    margin = 0.14 * s
    inner = s - 2 * margin
    row_h = inner / (len(ROWS) * 1.0 + (len(ROWS) - 1) * 0.35)
    gap_y = 0.35 * row_h
    col_w = inner / COLUMNS
    gap_x = max(0.08 * col_w, 1.0)
    radius = 0.12 * row_h
    for r, (colour, first) in enumerate(ROWS):
        y = margin + r * (row_h + gap_y)
        p.setBrush(QColor(colour))
        if size < 32:  # tiny sizes: one crisp bar per stage, snapped to whole pixels
            p.setRenderHint(QPainter.RenderHint.Antialiasing, False)
            x0, x1 = round(margin + first * col_w), round(margin + (first + BLOCKS_PER_ROW) * col_w)
            p.drawRect(x0, round(y), x1 - x0, max(round(row_h), 2))
            continue
        for k in range(BLOCKS_PER_ROW):
            x = margin + (first + k) * col_w
            p.drawRoundedRect(QRectF(x + gap_x / 2, y, col_w - gap_x, row_h), radius, radius)
    p.end()
    return img


def png_bytes(img: QImage) -> bytes:
    data = QByteArray()
    buf = QBuffer(data)
    buf.open(QIODevice.OpenModeFlag.WriteOnly)
    if not img.save(buf, "PNG"):
        raise RuntimeError("cannot encode PNG")
    buf.close()
    return bytes(data)


def bmp_entry(img: QImage) -> bytes:
    """An ICO image entry as a DIB: BITMAPINFOHEADER, 32-bit BGRA rows bottom-up, 1-bit AND mask."""
    img = img.convertToFormat(QImage.Format.Format_ARGB32)  # little-endian memory order: B, G, R, A
    w, h = img.width(), img.height()
    rows = [bytes(img.constScanLine(y))[: 4 * w] for y in range(h)]
    pixels = b"".join(reversed(rows))
    mask_stride = ((w + 31) // 32) * 4
    mask = bytearray()
    for y in reversed(range(h)):
        line = bytearray(mask_stride)
        row = rows[y]
        for x in range(w):
            if row[4 * x + 3] == 0:  # fully transparent: set the AND bit
                line[x // 8] |= 0x80 >> (x % 8)
        mask += line
    header = struct.pack("<IiiHHIIiiII", 40, w, 2 * h, 1, 32, 0, len(pixels) + len(mask), 0, 0, 0, 0)
    return header + pixels + bytes(mask)


def ico_bytes(images: list[QImage]) -> bytes:
    entries, blobs = [], []
    offset = 6 + 16 * len(images)
    for img in images:
        blob = png_bytes(img) if img.width() >= 256 else bmp_entry(img)
        dim = 0 if img.width() >= 256 else img.width()  # 0 means 256
        entries.append(struct.pack("<BBBBHHII", dim, dim, 0, 0, 1, 32, len(blob), offset))
        blobs.append(blob)
        offset += len(blob)
    return struct.pack("<HHH", 0, 1, len(images)) + b"".join(entries) + b"".join(blobs)


def main() -> int:
    app = QGuiApplication.instance() or QGuiApplication(sys.argv[:1])  # noqa: F841
    ASSETS.mkdir(parents=True, exist_ok=True)
    png = ASSETS / "strata.png"
    png.write_bytes(png_bytes(draw(PNG_SIZE)))
    ico = ASSETS / "strata.ico"
    ico.write_bytes(ico_bytes([draw(n) for n in ICO_SIZES]))
    print(f"wrote {png} ({png.stat().st_size} bytes) and {ico} ({ico.stat().st_size} bytes, "
          f"sizes {', '.join(map(str, ICO_SIZES))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
