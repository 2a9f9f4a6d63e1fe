"""the bytes each stored response takes, and each app's total (its cap is ``response_max_app_bytes``)

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-29
"""
from alembic import op
import sqlalchemy as sa

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('stored_responses', schema=None) as b:
        b.add_column(sa.Column('size_bytes', sa.Integer(), nullable=False, server_default='0'))
    size = ("octet_length(input_items) + octet_length(output_items) + octet_length(response)"
            if op.get_bind().dialect.name == "postgresql" else
            "length(CAST(input_items AS BLOB)) + length(CAST(output_items AS BLOB)) + length(CAST(response AS BLOB))")
    op.execute(f"UPDATE stored_responses SET size_bytes = {size}")
    op.create_table(
        'stored_response_bytes',
        sa.Column('app', sa.String(128), primary_key=True),
        sa.Column('bytes', sa.BigInteger(), nullable=False),
    )
    op.execute("INSERT INTO stored_response_bytes (app, bytes) "
               "SELECT app, SUM(size_bytes) FROM stored_responses GROUP BY app")


def downgrade() -> None:
    op.drop_table('stored_response_bytes')
    with op.batch_alter_table('stored_responses', schema=None) as b:
        b.drop_column('size_bytes')
