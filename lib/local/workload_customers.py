"""The workload's customer operations: contact and address changes, new and closed customers, joint holders, cards
and branch visits.

Each takes (cur, rng, ids, now, tally): ids holds the sorted lists ids["customers"] and ids["accounts"] of rows
that exist; now is the simulated clock."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

from lib.local import sample_data, sample_rows, workload_payments, workload_sql

MIN_CUSTOMERS = 10  # close_customer turns into new_customer below this


def update_contact(cur, rng, ids, now, tally):
    """A customer changes email and/or phone (PII update; phone may become NULL)."""
    customer_id = rng.choice(ids["customers"])
    cur.execute(
        "SELECT first_name, last_name, email, phone FROM bank.customers WHERE customer_id = %s",
        (customer_id,),
    )
    first, last, email, phone = cur.fetchone()
    change = rng.choice(("email", "phone", "both"))
    if change in ("email", "both"):
        email = sample_rows.random_email(rng, first, last)
    if change in ("phone", "both"):
        phone = sample_rows.random_phone(rng) if rng.random() < 0.9 else None
    workload_sql.write(
        cur,
        tally,
        "updates",
        "customers",
        "UPDATE bank.customers SET email = %s, phone = %s, updated_at = %s WHERE customer_id = %s",
        (email, phone, now, customer_id),
    )


def move_address(cur, rng, ids, now, tally):
    """A customer moves: home address updated in place; the mailing address may be added or dropped."""
    customer_id = rng.choice(ids["customers"])
    home = sample_rows.random_address(rng, "home")
    workload_sql.write(
        cur,
        tally,
        "updates",
        "addresses",
        "UPDATE bank.addresses SET line1 = %s, line2 = %s, city = %s, region = %s, postal_code = %s,"
        " valid_from = %s, updated_at = %s WHERE customer_id = %s AND kind = 'home'",
        (
            home["line1"],
            home["line2"],
            home["city"],
            home["region"],
            home["postal_code"],
            now.date(),
            now,
            customer_id,
        ),
    )
    if rng.random() < 0.4:
        has_mailing = workload_sql.column(
            cur,
            "SELECT address_id FROM bank.addresses WHERE customer_id = %s AND kind = 'mailing'",
            (customer_id,),
        )
        if has_mailing:
            workload_sql.write(
                cur,
                tally,
                "deletes",
                "addresses",
                "DELETE FROM bank.addresses WHERE customer_id = %s AND kind = 'mailing'",
                (customer_id,),
            )
        else:
            mailing = {
                "customer_id": customer_id,
                **sample_rows.random_address(rng, "mailing"),
                "valid_from": now.date(),
                "updated_at": now,
            }
            workload_sql.insert(cur, tally, "addresses", [mailing])


def new_customer(cur, rng, ids, now, tally):
    """Onboarding: customer, 1-2 addresses, checking account, holder, card and opening deposit."""
    person = sample_rows.random_person(rng, now)
    (customer_id,) = workload_sql.insert(cur, tally, "customers", [person], returning="customer_id")
    kinds = ("home", "mailing") if rng.random() < 0.3 else ("home",)
    workload_sql.insert(
        cur,
        tally,
        "addresses",
        [
            {
                "customer_id": customer_id,
                **sample_rows.random_address(rng, kind),
                "valid_from": now.date(),
                "updated_at": now,
            }
            for kind in kinds
        ],
    )
    deposit = sample_rows.money(rng, 50, 5000)
    account = {
        "account_number": f"NWB{rng.randint(10, 99)}-N{customer_id:07d}",
        "account_type": "checking",
        "status": "open",
        "currency": "USD",
        "balance": deposit,
        "credit_limit": None,
        "interest_rate": Decimal("0.0001"),
        "branch_code": person["home_branch"],
        "opened_on": now.date(),
        "closed_on": None,
        "updated_at": now,
    }
    (account_id,) = workload_sql.insert(cur, tally, "accounts", [account], returning="account_id")
    workload_sql.insert(
        cur,
        tally,
        "account_holders",
        [{"account_id": account_id, "customer_id": customer_id, "role": "primary", "added_on": now.date()}],
    )
    workload_sql.insert(cur, tally, "cards", [sample_rows.random_card(rng, account_id, customer_id, now)])
    workload_sql.insert(
        cur,
        tally,
        "transactions",
        [sample_rows.plain_transaction(rng, account_id, "deposit", deposit, now, "Opening deposit")],
    )
    ids["customers"].append(customer_id)
    ids["accounts"].append(account_id)


def add_joint_holder(cur, rng, ids, now, tally):
    """Another customer joins an account (composite-PK insert) and gets a card unless it is savings."""
    account_id = rng.choice(ids["accounts"])
    holders = set(
        workload_sql.column(
            cur,
            "SELECT customer_id FROM bank.account_holders WHERE account_id = %s ORDER BY 1",
            (account_id,),
        )
    )
    candidates = [c for c in rng.sample(ids["customers"], min(5, len(ids["customers"]))) if c not in holders]
    if not candidates:
        return update_contact(cur, rng, ids, now, tally)
    customer_id = candidates[0]
    workload_sql.insert(
        cur,
        tally,
        "account_holders",
        [
            {
                "account_id": account_id,
                "customer_id": customer_id,
                "role": rng.choice(("joint", "authorized_user")),
                "added_on": now.date(),
            }
        ],
    )
    cur.execute("SELECT account_type FROM bank.accounts WHERE account_id = %s", (account_id,))
    if cur.fetchone()[0] != "savings":
        workload_sql.insert(cur, tally, "cards", [sample_rows.random_card(rng, account_id, customer_id, now)])


def remove_joint_holder(cur, rng, ids, now, tally):
    """A non-primary holder leaves an account: their cards go (history kept), then the holder row."""
    pairs = workload_sql.pairs(
        cur,
        "SELECT account_id, customer_id FROM bank.account_holders"
        " WHERE role <> 'primary' ORDER BY account_id, customer_id",
    )
    if not pairs:
        return add_joint_holder(cur, rng, ids, now, tally)
    account_id, customer_id = rng.choice(pairs)
    workload_sql.write(
        cur,
        tally,
        "updates",
        "transactions",
        "UPDATE bank.transactions SET card_id = NULL WHERE card_id IN"
        " (SELECT card_id FROM bank.cards WHERE account_id = %s AND customer_id = %s)",
        (account_id, customer_id),
    )
    workload_sql.write(
        cur,
        tally,
        "deletes",
        "cards",
        "DELETE FROM bank.cards WHERE account_id = %s AND customer_id = %s",
        (account_id, customer_id),
    )
    workload_sql.write(
        cur,
        tally,
        "deletes",
        "account_holders",
        "DELETE FROM bank.account_holders WHERE account_id = %s AND customer_id = %s",
        (account_id, customer_id),
    )


def replace_card(cur, rng, ids, now, tally):
    """A card is reported lost: block it and issue a new one (new bytea chip token)."""
    account_id = rng.choice(ids["accounts"])
    cards = workload_sql.pairs(
        cur,
        "SELECT card_id, customer_id FROM bank.cards WHERE account_id = %s AND is_active ORDER BY card_id",
        (account_id,),
    )
    if not cards:
        return workload_payments.card_purchase(cur, rng, ids, now, tally)
    card_id, customer_id = rng.choice(cards)
    workload_sql.write(
        cur,
        tally,
        "updates",
        "cards",
        "UPDATE bank.cards SET is_active = false, blocked_reason = %s WHERE card_id = %s",
        (rng.choice(("lost", "stolen", "damaged", "suspected fraud")), card_id),
    )
    workload_sql.insert(cur, tally, "cards", [sample_rows.random_card(rng, account_id, customer_id, now)])


def branch_visit(cur, rng, ids, now, tally):
    """1-3 visits appended to the log without primary key (insert only, see sample_bank.sql)."""
    branch = rng.choice(sample_data.BRANCHES)[0]
    workload_sql.insert(
        cur,
        tally,
        "branch_visits",
        [
            sample_rows.branch_visit(
                rng,
                branch,
                rng.choice(ids["customers"]) if rng.random() < 0.9 else None,
                now + timedelta(minutes=7 * i),
            )
            for i in range(rng.randint(1, 3))
        ],
    )


def close_customer(cur, rng, ids, now, tally):
    """A customer leaves: explicit deletes of every child row, children first (no ON DELETE CASCADE)."""
    # Accounts they are primary holder of go with their transactions, statements, cards and
    # holders; on other accounts only their own cards and holder rows go. branch_visits is kept.
    if len(ids["customers"]) <= MIN_CUSTOMERS:
        return new_customer(cur, rng, ids, now, tally)
    customer_id = rng.choice(ids["customers"])
    owned = workload_sql.column(
        cur,
        "SELECT account_id FROM bank.account_holders WHERE customer_id = %s AND role = 'primary'"
        " ORDER BY account_id",
        (customer_id,),
    )
    workload_sql.write(
        cur,
        tally,
        "updates",
        "transactions",
        "UPDATE bank.transactions SET card_id = NULL WHERE card_id IN (SELECT card_id FROM bank.cards"
        " WHERE customer_id = %s AND account_id <> ALL(%s))",
        (customer_id, owned),
    )
    workload_sql.write(
        cur,
        tally,
        "deletes",
        "transactions",
        "DELETE FROM bank.transactions WHERE account_id = ANY(%s)",
        (owned,),
    )
    workload_sql.write(
        cur,
        tally,
        "deletes",
        "statements",
        "DELETE FROM bank.statements WHERE account_id = ANY(%s)",
        (owned,),
    )
    workload_sql.write(
        cur,
        tally,
        "deletes",
        "cards",
        "DELETE FROM bank.cards WHERE account_id = ANY(%s) OR customer_id = %s",
        (owned, customer_id),
    )
    workload_sql.write(
        cur,
        tally,
        "deletes",
        "account_holders",
        "DELETE FROM bank.account_holders WHERE account_id = ANY(%s) OR customer_id = %s",
        (owned, customer_id),
    )
    workload_sql.write(
        cur, tally, "deletes", "accounts", "DELETE FROM bank.accounts WHERE account_id = ANY(%s)", (owned,)
    )
    workload_sql.write(
        cur,
        tally,
        "deletes",
        "addresses",
        "DELETE FROM bank.addresses WHERE customer_id = %s",
        (customer_id,),
    )
    workload_sql.write(
        cur,
        tally,
        "deletes",
        "customers",
        "DELETE FROM bank.customers WHERE customer_id = %s",
        (customer_id,),
    )
    ids["customers"].remove(customer_id)
    for account_id in owned:
        ids["accounts"].remove(account_id)
