"""the Responses API's stored responses (the gateway's own, scoped to the app and user that made them), and the
reasoning tokens of a usage row

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-29
"""
from alembic import op
import sqlalchemy as sa

from fairgate.storage.models import UTCDateTime

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'stored_responses',
        sa.Column('id', sa.String(64), primary_key=True),
        sa.Column('app', sa.String(128), nullable=False),
        sa.Column('user', sa.String(256), nullable=False),
        sa.Column('previous_id', sa.String(64), nullable=True),
        sa.Column('interaction', sa.String(256), nullable=False),
        sa.Column('turn', sa.Integer(), nullable=False),
        sa.Column('chain_bytes', sa.Integer(), nullable=False),
        sa.Column('backend', sa.String(256), nullable=True),
        sa.Column('created_at', UTCDateTime(), nullable=False),
        sa.Column('expires_at', UTCDateTime(), nullable=False),
        sa.Column('input_items', sa.Text(), nullable=False),
        sa.Column('output_items', sa.Text(), nullable=False),
        sa.Column('response', sa.Text(), nullable=False),
    )
    op.create_index('ix_stored_responses_expires_at', 'stored_responses', ['expires_at'])
    with op.batch_alter_table('usage_log', schema=None) as b:
        b.add_column(sa.Column('reasoning_tokens', sa.Integer(), nullable=False, server_default='0'))


def downgrade() -> None:
    with op.batch_alter_table('usage_log', schema=None) as b:
        b.drop_column('reasoning_tokens')
    op.drop_index('ix_stored_responses_expires_at', table_name='stored_responses')
    op.drop_table('stored_responses')
