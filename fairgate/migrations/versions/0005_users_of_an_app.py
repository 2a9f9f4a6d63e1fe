"""users belong to an app (the same name in two apps is two users); existing users become shared users

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23
"""
from alembic import op
import sqlalchemy as sa

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None

# 0001 left the unique constraint on users.name unnamed: PostgreSQL named it users_name_key, SQLite not at all
# (batch mode names a reflected unnamed constraint by this convention, so that it can be dropped).
SQLITE_NAMES = {"uq": "uq_%(table_name)s_%(column_0_name)s"}


def upgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    if not sqlite:
        op.drop_constraint('users_name_key', 'users', type_='unique')
    with op.batch_alter_table('users', schema=None, naming_convention=SQLITE_NAMES if sqlite else None) as b:
        if sqlite:
            b.drop_constraint('uq_users_name', type_='unique')
        b.add_column(sa.Column('app_id', sa.Integer(), nullable=True))
        b.create_foreign_key('fk_users_app_id', 'apps', ['app_id'], ['id'])
        b.create_unique_constraint('uq_users_app_name', ['app_id', 'name'])


def downgrade() -> None:
    with op.batch_alter_table('users', schema=None) as b:
        b.drop_constraint('uq_users_app_name', type_='unique')
        b.drop_constraint('fk_users_app_id', type_='foreignkey')
        b.drop_column('app_id')
        b.create_unique_constraint('uq_users_name', ['name'])
