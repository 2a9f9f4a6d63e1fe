"""usage rows record the calibrated p90 TTFT predicted for the request at admission

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-25
"""
from alembic import op
import sqlalchemy as sa

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('usage_log', schema=None) as b:
        b.add_column(sa.Column('predicted_ttft_ms', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('usage_log', schema=None) as b:
        b.drop_column('predicted_ttft_ms')
