"""the client's x-request-id in its own column (the gateway's request_id is now always its own, unique)

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""
from alembic import op
import sqlalchemy as sa

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('usage_log', schema=None) as batch_op:
        batch_op.add_column(sa.Column('client_request_id', sa.String(length=128), nullable=True))
        batch_op.create_index(batch_op.f('ix_usage_log_client_request_id'), ['client_request_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('usage_log', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_usage_log_client_request_id'))
        batch_op.drop_column('client_request_id')
