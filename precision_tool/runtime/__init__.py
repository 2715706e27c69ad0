"""The runtime layer: Session, the CPU golden executor, execution plans."""
from .config import SessionConfig
from .session import Session

__all__ = ["Session", "SessionConfig"]
