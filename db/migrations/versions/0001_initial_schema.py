"""Initial schema: runs, steps, device transitions, reshard / migration / scheduler events.

Revision ID: 0001
Revises:
Create Date: 2026-11-29

Written out in full (no imports from db.models): a revision is a fixed point in the schema's history,
and must keep meaning the same thing after the models move on. Only CREATE/DROP here, so it runs on SQLite
and PostgreSQL unchanged; later revisions that alter tables use `op.batch_alter_table` for SQLite.
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OWNERS = "('free', 'actor', 'rollout', 'inference', 'moving')"  # tidal.core.devices.Owner values at this revision
EVENT_TABLES = ("device_transitions", "reshard_events", "migration_events", "scheduler_events")


def _id() -> sa.Column:
    return sa.Column("id", sa.Integer(), autoincrement=True, nullable=False)


def _run_id(table: str) -> tuple[sa.Column, sa.ForeignKeyConstraint]:
    return (sa.Column("run_id", sa.Integer(), nullable=False),
            sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f(f"fk_{table}_run_id_runs"), ondelete="CASCADE"))


def upgrade() -> None:
    op.create_table(
        "runs",
        _id(),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("mlflow_run_id", sa.String(length=64), nullable=True),
        sa.Column("output_dir", sa.Text(), nullable=True),
        sa.CheckConstraint("status IN ('running', 'finished', 'failed', 'aborted')", name=op.f("ck_runs_status")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
    )
    op.create_table(
        "steps",
        *_run_id("steps"),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("eval_accuracy", sa.Float(), nullable=True),
        sa.Column("step_seconds", sa.Float(), nullable=False),
        sa.Column("phase_seconds", sa.JSON(), nullable=False),
        sa.Column("device_idle_fraction", sa.Float(), nullable=True),
        sa.CheckConstraint("device_idle_fraction >= 0 AND device_idle_fraction <= 1",
                           name=op.f("ck_steps_idle_fraction")),
        sa.PrimaryKeyConstraint("run_id", "step", name=op.f("pk_steps")),
    )
    op.create_table(
        "device_transitions",
        _id(),
        *_run_id("device_transitions"),
        sa.Column("device_id", sa.Integer(), nullable=False),
        sa.Column("from_owner", sa.String(length=16), nullable=False),
        sa.Column("to_owner", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("time", sa.Float(), nullable=False),
        sa.CheckConstraint(f"from_owner IN {OWNERS}", name=op.f("ck_device_transitions_from_owner")),
        sa.CheckConstraint(f"to_owner IN {OWNERS}", name=op.f("ck_device_transitions_to_owner")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_device_transitions")),
    )
    op.create_index(op.f("ix_device_transitions_run_id_device_id"), "device_transitions", ["run_id", "device_id"])
    op.create_table(
        "reshard_events",
        _id(),
        *_run_id("reshard_events"),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("iter", sa.Integer(), nullable=False),
        sa.Column("from_layout", sa.JSON(), nullable=False),
        sa.Column("to_layout", sa.JSON(), nullable=False),
        sa.Column("devices", sa.JSON(), nullable=False),
        sa.Column("bytes_moved", sa.BigInteger(), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.Column("ok", sa.Boolean(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_reshard_events")),
    )
    op.create_table(
        "migration_events",
        _id(),
        *_run_id("migration_events"),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("request_id", sa.String(length=64), nullable=False),
        sa.Column("group_id", sa.String(length=64), nullable=False),
        sa.Column("source_instance", sa.String(length=64), nullable=False),
        sa.Column("target_instance", sa.String(length=64), nullable=False),
        sa.Column("mode", sa.String(length=16), nullable=False),
        sa.Column("tokens", sa.Integer(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.Column("ok", sa.Boolean(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.CheckConstraint("mode IN ('kv', 'reprefill')", name=op.f("ck_migration_events_mode")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_migration_events")),
    )
    op.create_table(
        "scheduler_events",
        _id(),
        *_run_id("scheduler_events"),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("iter", sa.Integer(), nullable=True),
        sa.Column("time", sa.Float(), nullable=False),
        sa.Column("policy", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("action_type", sa.String(length=64), nullable=True),
        sa.Column("devices", sa.JSON(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("outcome", sa.Text(), nullable=True),
        sa.CheckConstraint("kind IN ('decision', 'action')", name=op.f("ck_scheduler_events_kind")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_scheduler_events")),
    )
    for table in ("reshard_events", "migration_events", "scheduler_events"):
        op.create_index(op.f(f"ix_{table}_run_id_step"), table, ["run_id", "step"])


def downgrade() -> None:
    for table in reversed(EVENT_TABLES):
        op.drop_table(table)  # drops its indexes with it
    op.drop_table("steps")
    op.drop_table("runs")
