"""usage rows record the request's SLO class, its targets, its observed ATGT and whether it met them

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-25
"""
from alembic import op
import sqlalchemy as sa

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None

COLUMNS = (("slo_class", sa.String(64)), ("slo_ttft_ms", sa.Float()), ("slo_atgt_ms", sa.Float()),
           ("atgt_ms", sa.Float()), ("slo_met", sa.Boolean()))


def upgrade() -> None:
    with op.batch_alter_table('usage_log', schema=None) as b:
        for name, type_ in COLUMNS:
            b.add_column(sa.Column(name, type_, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('usage_log', schema=None) as b:
        for name, _ in reversed(COLUMNS):
            b.drop_column(name)
