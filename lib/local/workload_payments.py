"""The workload's money operations: card purchases, transfers, statements, settlements, interest.

Each takes (cur, rng, ids, now, tally): ids holds the sorted lists ids["customers"] and ids["accounts"] of rows
that exist; now is the simulated clock."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

from lib.local import sample_data, sample_rows, workload_sql


def card_purchase(cur, rng, ids, now, tally):
    """1-4 card payments (one multi-row insert) on an account, then its balance update."""
    # an account without an active card (savings) pays a direct debit instead
    account_id = rng.choice(ids["accounts"])
    cards = workload_sql.column(
        cur,
        "SELECT card_id FROM bank.cards WHERE account_id = %s AND is_active ORDER BY card_id",
        (account_id,),
    )
    if cards:
        rows = [
            sample_rows.card_payment(
                rng,
                account_id,
                rng.choice(cards),
                now + timedelta(seconds=i),
                "pending" if rng.random() < 0.4 else "posted",
            )
            for i in range(rng.randint(1, 4))
        ]
    else:
        payee, mcc = rng.choice(sample_data.DIRECT_DEBITS)
        rows = [
            sample_rows.plain_transaction(
                rng,
                account_id,
                "direct_debit",
                -sample_rows.money(rng, 20, 300),
                now,
                f"Direct debit {payee}",
                merchant={"name": payee, "mcc": mcc},
            )
        ]
    workload_sql.insert(cur, tally, "transactions", rows)
    workload_sql.change_balance(cur, tally, account_id, sum((r["amount"] for r in rows), Decimal(0)), now)


def transfer(cur, rng, ids, now, tally):
    """Move money between two accounts: two transaction rows, two balance updates."""
    source, target = rng.sample(ids["accounts"], 2)
    numbers = dict(
        workload_sql.pairs(
            cur,
            "SELECT account_id, account_number FROM bank.accounts WHERE account_id IN (%s, %s)",
            (source, target),
        )
    )
    amount = sample_rows.money(rng, 5, 1500)
    memo = rng.choice(("Rent", "Dinner", "Savings", "Gift", f"Invoice 2024-{rng.randint(1, 999):03d}"))
    workload_sql.insert(
        cur,
        tally,
        "transactions",
        [
            sample_rows.plain_transaction(
                rng,
                source,
                "transfer_out",
                -amount,
                now,
                f"Transfer to {numbers[target]}: {memo}",
                counterparty=numbers[target],
            ),
            sample_rows.plain_transaction(
                rng,
                target,
                "transfer_in",
                amount,
                now,
                f"Transfer from {numbers[source]}: {memo}",
                counterparty=numbers[source],
            ),
        ],
    )
    workload_sql.change_balance(cur, tally, source, -amount, now)
    workload_sql.change_balance(cur, tally, target, amount, now)


def view_statement(cur, rng, ids, now, tally):
    """A customer opens a statement: viewed_at/view_count change, the big TOASTed body does not."""
    if rng.random() < 0.6:  # prefer the long (out-of-line) bodies, the interesting CDC case
        query = "SELECT statement_id FROM bank.statements WHERE pg_column_size(body) > 2048 ORDER BY 1"
    else:
        query = "SELECT statement_id FROM bank.statements ORDER BY 1"
    statements = workload_sql.column(cur, query)
    if not statements:
        return issue_statement(cur, rng, ids, now, tally)
    workload_sql.write(
        cur,
        tally,
        "updates",
        "statements",
        "UPDATE bank.statements SET viewed_at = %s, view_count = view_count + 1,"
        " delivery = CASE WHEN delivery = 'post' THEN 'app' ELSE delivery END WHERE statement_id = %s",
        (now, rng.choice(statements)),
    )


def issue_statement(cur, rng, ids, now, tally):
    """The bank renders a statement of an account's latest transactions (often > 2 kB)."""
    account_id = rng.choice(ids["accounts"])
    cur.execute(
        "SELECT a.account_number, a.balance, c.first_name || ' ' || c.last_name, c.customer_id"
        " FROM bank.accounts a"
        " JOIN bank.account_holders h ON h.account_id = a.account_id AND h.role = 'primary'"
        " JOIN bank.customers c ON c.customer_id = h.customer_id"
        " WHERE a.account_id = %s",
        (account_id,),
    )
    number, balance, holder, customer_id = cur.fetchone()
    cur.execute(
        "SELECT line1, line2, city, region, postal_code FROM bank.addresses"
        " WHERE customer_id = %s AND kind = 'home'",
        (customer_id,),
    )
    address = dict(zip(("line1", "line2", "city", "region", "postal_code"), cur.fetchone(), strict=True))
    cur.execute(
        "SELECT (booked_at AT TIME ZONE 'UTC')::date, description, amount FROM bank.transactions"
        " WHERE account_id = %s ORDER BY booked_at DESC, transaction_id LIMIT 40",
        (account_id,),
    )
    lines = list(reversed(cur.fetchall()))
    opening = balance - sum((amount for _, _, amount in lines), Decimal(0))
    period = ((now - timedelta(days=30)).date(), now.date())
    body = sample_rows.render_statement(
        number, holder, address, period, opening, lines, disclosures=rng.random() < 0.5
    )
    workload_sql.insert(
        cur,
        tally,
        "statements",
        [
            {
                "account_id": account_id,
                "period_start": period[0],
                "period_end": period[1],
                "opening_balance": opening,
                "closing_balance": balance,
                "body": body,
                "delivery": rng.choice(("email", "app", "post")),
                "viewed_at": None,
                "view_count": 0,
                "generated_at": now,
            }
        ],
    )


def settle_payment(cur, rng, ids, now, tally):
    """A pending card payment posts, sometimes with a tip: amount, status, tags and jsonb change."""
    pending = workload_sql.pairs(
        cur,
        "SELECT transaction_id, account_id FROM bank.transactions WHERE status = 'pending'"
        " ORDER BY booked_at, transaction_id LIMIT 10",
    )
    if not pending:
        return card_purchase(cur, rng, ids, now, tally)
    transaction_id, account_id = rng.choice(pending)
    tip = sample_rows.money(rng, 1, 15) if rng.random() < 0.3 else Decimal("0.00")
    workload_sql.write(
        cur,
        tally,
        "updates",
        "transactions",
        "UPDATE bank.transactions SET status = 'posted', amount = amount - %s,"
        " tags = array_append(tags, 'settled'),"
        " merchant = merchant || jsonb_build_object('tip', %s::numeric), value_date = %s"
        " WHERE transaction_id = %s",
        (tip, tip, now.date(), transaction_id),
    )
    if tip:
        workload_sql.change_balance(cur, tally, account_id, -tip, now)


def expire_authorization(cur, rng, ids, now, tally):
    """The oldest pending card payment is never captured: delete it and give the money back."""
    cur.execute(
        "SELECT transaction_id, account_id, amount FROM bank.transactions WHERE status = 'pending'"
        " ORDER BY booked_at, transaction_id LIMIT 1"
    )
    row = cur.fetchone()
    if row is None:
        return card_purchase(cur, rng, ids, now, tally)
    transaction_id, account_id, amount = row
    workload_sql.write(
        cur,
        tally,
        "deletes",
        "transactions",
        "DELETE FROM bank.transactions WHERE transaction_id = %s",
        (transaction_id,),
    )
    workload_sql.change_balance(cur, tally, account_id, -amount, now)


def accrue_interest(cur, rng, ids, now, tally):
    """Monthly interest on a savings account: interest transaction plus balance update."""
    savings = workload_sql.pairs(
        cur,
        "SELECT account_id, round(balance * interest_rate / 12, 2) FROM bank.accounts"
        " WHERE account_type = 'savings' AND balance > 0 ORDER BY account_id",
    )
    if not savings:
        return transfer(cur, rng, ids, now, tally)
    account_id, interest = rng.choice(savings)
    workload_sql.insert(
        cur,
        tally,
        "transactions",
        [sample_rows.plain_transaction(rng, account_id, "interest", interest, now, "Monthly interest")],
    )
    workload_sql.change_balance(cur, tally, account_id, interest, now)
