from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('routing', '0007_cache_version'),
    ]

    operations = [
        migrations.AddField(
            model_name='requestrecord',
            name='finish_reason',
            field=models.CharField(blank=True, help_text='Why generation ended, as OpenAI says it (stop, length); blank when the request did not finish (error, cancelled, rejected, interrupted).', max_length=16),
        ),
    ]
