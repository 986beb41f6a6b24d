"""What an image's bytes are, by their first bytes: the four types both APIs accept
(Anthropic's list; OpenAI's is the same). A placeholder is made only of an image the real
API would have read, so a request it refuses is refused here too, with its status.

    sniff_image(data) -> "image/png" | "image/jpeg" | "image/gif" | "image/webp" | None
"""

from __future__ import annotations

IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")  # Anthropic's order

_PNG = b"\x89PNG\r\n\x1a\n"
_JPEG = b"\xff\xd8\xff"  # SOI, then the first marker's 0xFF
_GIF = (b"GIF87a", b"GIF89a")


def sniff_image(data: bytes) -> str | None:
    """The type of image `data` holds, by its signature; None if none of IMAGE_TYPES."""
    if data.startswith(_PNG):
        return "image/png"
    if data.startswith(_JPEG):
        return "image/jpeg"
    if data.startswith(_GIF):
        return "image/gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":  # RIFF, its length, the form type
        return "image/webp"
    return None
