"""A run's row holds the id of the Prefect flow run that drove it, beside its MLflow run's id.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03

`runs.prefect_flow_run_id`: the flow run (a UUID) of a run started by the `rl-training` flow; NULL for a run
started by `tidal train` without `--flow`. Indexed: the platform looks a run up by its flow run. Batch mode, as
in 0002, so SQLite rebuilds the table where it cannot alter it in place.
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("prefect_flow_run_id", sa.String(length=64), nullable=True))
        batch.create_index(op.f("ix_runs_prefect_flow_run_id"), ["prefect_flow_run_id"])


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_index(op.f("ix_runs_prefect_flow_run_id"))
        batch.drop_column("prefect_flow_run_id")
