"""A device may be `failed` (tidal.core.devices.Owner.FAILED), and each fault is a row of `fault_events`: a device
lost, its work done again, the device back in the free pool, with seconds, bytes, groups and tokens.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03

SQLite cannot alter a CHECK constraint in place: batch mode rebuilds the table (named constraints, see 0001).
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD = "('free', 'actor', 'rollout', 'inference', 'moving', 'shared')"
NEW = "('free', 'actor', 'rollout', 'inference', 'moving', 'shared', 'failed')"


def _owners(values: str) -> None:
    with op.batch_alter_table("device_transitions") as batch:
        for column in ("from_owner", "to_owner"):
            batch.drop_constraint(op.f(f"ck_device_transitions_{column}"), type_="check")
            batch.create_check_constraint(column, f"{column} IN {values}")


def upgrade() -> None:
    _owners(NEW)
    op.create_table(
        "fault_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("time", sa.Float(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("device_id", sa.Integer(), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("groups", sa.Integer(), nullable=False),
        sa.Column("tokens", sa.Integer(), nullable=False),
        sa.CheckConstraint("kind IN ('failed', 'recovered', 'rejoined')", name=op.f("ck_fault_events_kind")),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_fault_events_run_id_runs"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_fault_events")),
    )
    op.create_index(op.f("ix_fault_events_run_id_step"), "fault_events", ["run_id", "step"])


def downgrade() -> None:
    op.drop_table("fault_events")   # drops its index with it
    op.execute("DELETE FROM device_transitions WHERE from_owner = 'failed' OR to_owner = 'failed'")
    _owners(OLD)
