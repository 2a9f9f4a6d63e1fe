"""fair queue: fairness columns on the usage log, and run-time settings

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""
from alembic import op
import sqlalchemy as sa

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('usage_log', schema=None) as batch_op:
        batch_op.add_column(sa.Column('fairness_key', sa.String(length=300), nullable=True))
        batch_op.add_column(sa.Column('policy', sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column('queue_wait_ms', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('counter_before', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('counter_after', sa.Float(), nullable=True))
    op.create_table('settings',
    sa.Column('key', sa.String(length=64), nullable=False),
    sa.Column('value', sa.Text(), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('key')
    )


def downgrade() -> None:
    op.drop_table('settings')
    with op.batch_alter_table('usage_log', schema=None) as batch_op:
        for col in ('counter_after', 'counter_before', 'queue_wait_ms', 'policy', 'fairness_key'):
            batch_op.drop_column(col)
