"""Device ownership may be `shared`: a static collocated or hybrid placement time-shares a device between
components (tidal.core.devices.Owner.SHARED).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02

SQLite cannot alter a CHECK constraint in place: batch mode rebuilds the table (named constraints, see 0001).
"""
from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD = "('free', 'actor', 'rollout', 'inference', 'moving')"
NEW = "('free', 'actor', 'rollout', 'inference', 'moving', 'shared')"


def _owners(values: str) -> None:
    with op.batch_alter_table("device_transitions") as batch:
        for column in ("from_owner", "to_owner"):
            batch.drop_constraint(op.f(f"ck_device_transitions_{column}"), type_="check")
            batch.create_check_constraint(column, f"{column} IN {values}")


def upgrade() -> None:
    _owners(NEW)


def downgrade() -> None:
    op.execute("DELETE FROM device_transitions WHERE from_owner = 'shared' OR to_owner = 'shared'")
    _owners(OLD)
